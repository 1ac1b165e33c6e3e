// The `vramledger._core` extension: trace replay and options parsing for the Python package.
// Stateless; the GIL is released while a trace is read and replayed.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "replay/replay.h"
#include "replay/replay_report.h"
#include "replay/trace_reader.h"
#include "vramledger/options.h"

namespace py = pybind11;

namespace vramledger {
namespace {

// Raises the Python exception that fits `status`: ValueError for bad input (trace, options),
// FileNotFoundError / PermissionError for files, MemoryError for simulated OOM, else RuntimeError.
[[noreturn]] void Raise(const absl::Status& status) {
  const std::string message(status.message());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kDataLoss:
      throw py::value_error(message);
    case absl::StatusCode::kNotFound:
      PyErr_SetString(PyExc_FileNotFoundError, message.c_str());
      throw py::error_already_set();
    case absl::StatusCode::kPermissionDenied:
      PyErr_SetString(PyExc_PermissionError, message.c_str());
      throw py::error_already_set();
    case absl::StatusCode::kResourceExhausted:
      PyErr_SetString(PyExc_MemoryError, message.c_str());
      throw py::error_already_set();
    default:
      throw std::runtime_error(message);
  }
}

template <typename T>
T ValueOrRaise(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

// nlohmann::json -> Python object (dict, list, int, float, str, bool, None).
py::object ToPython(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::object: {
      py::dict d;
      for (const auto& [key, value] : j.items()) d[py::str(key)] = ToPython(value);
      return d;
    }
    case nlohmann::json::value_t::array: {
      py::list l;
      for (const auto& value : j) l.append(ToPython(value));
      return l;
    }
    case nlohmann::json::value_t::number_integer:
      return py::int_(j.get<std::int64_t>());
    case nlohmann::json::value_t::number_unsigned:
      return py::int_(j.get<std::uint64_t>());
    case nlohmann::json::value_t::number_float:
      return py::float_(j.get<double>());
    case nlohmann::json::value_t::string:
      return py::str(j.get<std::string>());
    case nlohmann::json::value_t::boolean:
      return py::bool_(j.get<bool>());
    default:
      return py::none();
  }
}

Options OptionsFor(const std::string& conf, bool use_env) {
  return ValueOrRaise(use_env ? OptionsFromEnvAndString(conf) : ParseOptions(conf));
}

// The result dict; with a timeline, its CSV text (TimelineCsv) under "timeline_csv".
py::object RunReplay(const std::vector<TraceEvent>& events, const Options& options,
                     const ReplayConfig& config) {
  absl::StatusOr<ReplayResult> result;
  {
    py::gil_scoped_release release;
    result = Replay(events, options, config);
  }
  const ReplayResult& r = ValueOrRaise(std::move(result));
  py::object out = ToPython(ReplayResultToJson(r));
  if (config.timeline) out["timeline_csv"] = py::str(TimelineCsv(r));
  return out;
}

// What follows the trace's own figures: the program's releases, and the plan's handling.
struct FollowArgs {
  bool follow_releases = true;
  bool plan_keep_going = false;
  int device = 0;
  std::size_t max_refusals_listed = 10;
};

ReplayConfig ConfigFor(std::size_t capacity_bytes, const std::string& source, bool timeline,
                       std::int64_t sample_every, std::int64_t gpu_lag_us,
                       const FollowArgs& follow) {
  if (sample_every < 0) throw py::value_error("sample_every must be 0 (automatic) or positive");
  if (gpu_lag_us < 0) throw py::value_error("gpu_lag_us must be 0 (none) or positive");
  ReplayConfig config;
  config.capacity_bytes = capacity_bytes;
  config.source = source;
  config.timeline = timeline;
  config.sample_every = sample_every;
  config.gpu_lag_us = gpu_lag_us;
  config.follow_releases = follow.follow_releases;
  config.plan_keep_going = follow.plan_keep_going;
  config.device = follow.device;
  config.max_refusals_listed = follow.max_refusals_listed;
  return config;
}

py::object ReplayFile(const std::string& path, const std::string& conf, std::size_t capacity_bytes,
                      bool use_env, bool timeline, std::int64_t sample_every,
                      std::int64_t gpu_lag_us, bool follow_releases, bool plan_keep_going,
                      std::size_t max_refusals_listed) {
  const Options options = OptionsFor(conf, use_env);
  absl::StatusOr<std::vector<TraceEvent>> events;
  {
    py::gil_scoped_release release;
    events = ReadTraceFile(path);
  }
  const ReplayConfig config =
      ConfigFor(capacity_bytes, path, timeline, sample_every, gpu_lag_us,
                {follow_releases, plan_keep_going, /*device=*/0, max_refusals_listed});
  return RunReplay(ValueOrRaise(std::move(events)), options, config);
}

using EventTuple =
    std::tuple<std::string, std::uint64_t, std::uint64_t, std::uint64_t, std::int64_t>;

py::object ReplayEvents(const std::vector<EventTuple>& tuples, const std::string& conf,
                        std::size_t capacity_bytes, const std::string& source, bool use_env,
                        bool timeline, std::int64_t sample_every, std::int64_t gpu_lag_us,
                        bool follow_releases, bool plan_keep_going, int device,
                        std::size_t max_refusals_listed) {
  const Options options = OptionsFor(conf, use_env);
  std::vector<TraceEvent> events;
  events.reserve(tuples.size());
  for (std::size_t i = 0; i < tuples.size(); ++i) {
    const auto& [action_name, addr, size, stream, time_us] = tuples[i];
    const std::optional<TraceAction> action = ParseTraceAction(action_name);
    if (!action.has_value()) {
      throw py::value_error(
          absl::StrCat(source, ":", i + 1, ": unknown action '", action_name, "'"));
    }
    TraceEvent event;
    event.action = *action;
    event.addr = static_cast<DevicePtr>(addr);
    event.size = static_cast<std::size_t>(size);
    event.stream = static_cast<StreamId>(stream);
    event.time_us = time_us;
    event.line = static_cast<int>(i + 1);
    events.push_back(event);
  }
  if (device < 0) throw py::value_error("device must be a device index (0 or more)");
  return RunReplay(events, options,
                   ConfigFor(capacity_bytes, source, timeline, sample_every, gpu_lag_us,
                             {follow_releases, plan_keep_going, device, max_refusals_listed}));
}

py::dict OptionsToDict(const Options& o) {
  py::dict d;
  d["max_split_size"] = py::int_(o.max_split_size);
  d["max_non_split_rounding"] = py::int_(o.max_non_split_rounding);
  d["garbage_collection_threshold"] = o.garbage_collection_threshold;
  d["expandable_segments"] = o.expandable_segments;
  d["large_segment_size"] = py::int_(o.large_segment_size);
  py::list divisions;
  for (std::size_t v : o.roundup_power2_divisions) divisions.append(py::int_(v));
  d["roundup_power2_divisions"] = divisions;
  d["release_lock_on_cudamalloc"] = o.release_lock_on_cudamalloc;
  d["per_process_memory_fraction"] = o.per_process_memory_fraction;
  d["page_recycling"] = o.page_recycling;
  d["plan"] = o.process.plan;
  d["dump_dir"] = o.process.dump_dir;
  d["max_dumps"] = o.process.max_dumps;
  d["conf_string"] = o.conf_string;
  return d;
}

}  // namespace

// tools/python_ledger.cc: snapshots of replays, SimAllocator.
void RegisterLedgerBindings(py::module_& m);

}  // namespace vramledger

PYBIND11_MODULE(_core, m) {
  using namespace vramledger;  // NOLINT(build/namespaces): module definition only
  m.doc() = "vramledger's C++ core: trace replay on the simulated device, options parsing.";
  m.attr("H200_TOTAL_BYTES") = py::int_(kH200TotalBytes);
  m.attr("TIMELINE_CSV_HEADER") = py::str(kTimelineCsvHeader);

  m.def("replay_file", &ReplayFile, py::arg("path"), py::arg("conf") = "",
        py::arg("capacity_bytes") = kH200TotalBytes, py::arg("use_env") = true,
        py::arg("timeline") = false, py::arg("sample_every") = 0, py::arg("gpu_lag_us") = 0,
        py::arg("follow_releases") = true, py::arg("plan_keep_going") = false,
        py::arg("max_refusals_listed") = 10,
        "Replays a trace CSV (plain or .gz) on SimBackend; returns the dict of "
        "`vramledger replay --json` (sizes in bytes, times in microseconds).\n"
        "Options: VRAMLEDGER_CONF (if use_env) then `conf`, which wins.\n"
        "With timeline=True the dict also holds 'timeline_csv', the text of "
        "`vramledger replay --timeline` (a point at least every `sample_every` trace events; "
        "0 = about 2000 points in all).\n"
        "gpu_lag_us > 0: fences the allocator records complete that many microseconds of trace "
        "time later (a GPU running behind the host); 0: at once.\n"
        "follow_releases: empty the cache where the trace shows the program's releases "
        "(result['releases']). A plan in the options (plan:FILE) guards the simulated device: "
        "result['plan'] lists its refusals (the replay stops at the first unless "
        "plan_keep_going).\n"
        "Raises ValueError (malformed trace or options, message 'FILE:LINE: ...'), "
        "FileNotFoundError, MemoryError (the simulated device ran out; names the line).");
  m.def("replay_events", &ReplayEvents, py::arg("events"), py::arg("conf") = "",
        py::arg("capacity_bytes") = kH200TotalBytes, py::arg("source") = "<events>",
        py::arg("use_env") = true, py::arg("timeline") = false, py::arg("sample_every") = 0,
        py::arg("gpu_lag_us") = 0, py::arg("follow_releases") = true,
        py::arg("plan_keep_going") = false, py::arg("device") = 0,
        py::arg("max_refusals_listed") = 10,
        "Replays a list of (action: str, addr: int, size: int, stream: int, time_us: int) "
        "tuples (torch's action names); line numbers in messages and results are 1-based "
        "indices into the list, prefixed by `source`; `device` picks the plan's device rules. "
        "Returns the same dict as replay_file.");
  m.def(
      "parse_options",
      [](const std::string& conf, bool use_env) {
        return OptionsToDict(OptionsFor(conf, use_env));
      },
      py::arg("conf"), py::arg("use_env") = false,
      "Parses `key:value,...` (PYTORCH_CUDA_ALLOC_CONF syntax) into a dict of every option "
      "(sizes in bytes). Raises ValueError with the parser's message.");
  m.def(
      "option_table",
      [] {
        py::list rows;
        for (const OptionDoc& d : OptionTable()) {
          py::dict row;
          row["name"] = d.name;
          row["table"] = std::string(OptionScopeName(d.scope));
          row["type"] = d.type;
          row["default"] = d.default_value;
          row["accepted"] = d.accepted;
          row["help"] = d.doc;
          row["env"] = d.env;
          rows.append(row);
        }
        return rows;
      },
      "Every accepted option key, in the order errors list them, as dicts of str: name, table "
      "('allocator' or 'process'), type, default (as a settings string writes it), accepted, "
      "help, env (the environment variable that also sets it, or '').");
  m.def("options_markdown", &OptionsMarkdown,
        "docs/options.md as the option tables generate it (Markdown).");
  RegisterLedgerBindings(m);
}
