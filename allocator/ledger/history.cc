// The history's ring buffers, record modes and stack interning (hash of the raw frames -> id).
// Thread-safety: see history.h. Lock order: device lock -> ring lock; GIL -> mu_; leaves: the
// ring locks, mu_ and symbol_mu_ (nothing is acquired while one of them is held).
#include "ledger/history.h"

#include <time.h>

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace vramledger {
namespace {

std::uint64_t Mix(std::uint64_t h, std::uint64_t v) {
  // A 64-bit multiply-xorshift step (as in splitmix64); good enough to spread stack contents.
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h *= 0xbf58476d1ce4e5b9ULL;
  return h ^ (h >> 31);
}

std::uint64_t HashStack(const PythonFrameRef* python, int num_python, const std::uintptr_t* native,
                        int num_native) {
  std::uint64_t h = Mix(static_cast<std::uint64_t>(num_python), num_native);
  for (int i = 0; i < num_python; ++i) {
    h = Mix(h, python[i].code);
    h = Mix(h, static_cast<std::uint64_t>(static_cast<std::uint32_t>(python[i].position)));
  }
  for (int i = 0; i < num_native; ++i) h = Mix(h, native[i]);
  return h == 0 ? 1 : h;
}

// Epoch microseconds. clock_gettime is read directly: on the development VM it took 39 ns
// against 107 ns for absl::GetCurrentTimeNanos, and it is read once per recorded event.
std::int64_t NowMicros() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

bool IsSegmentGrowth(TraceAction a) {
  return a == TraceAction::kSegmentAlloc || a == TraceAction::kSegmentMap;
}
bool IsSegmentRelease(TraceAction a) {
  return a == TraceAction::kSegmentFree || a == TraceAction::kSegmentUnmap;
}

}  // namespace

absl::StatusOr<HistorySettings> ParseHistorySettings(std::optional<std::string_view> enabled,
                                                     std::optional<std::string_view> context,
                                                     std::string_view stacks,
                                                     std::uint64_t max_entries) {
  HistorySettings s;
  if (!enabled.has_value()) {
    s.enabled = HistoryEnabled::kNone;
  } else if (*enabled == "state") {
    s.enabled = HistoryEnabled::kState;
  } else if (*enabled == "all") {
    s.enabled = HistoryEnabled::kAll;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("record_memory_history: enabled='", std::string(*enabled),
                     "' is not accepted; expected None, 'state' or 'all'"));
  }
  if (!context.has_value()) {
    s.context = HistoryContext::kNone;
  } else if (*context == "state") {
    s.context = HistoryContext::kState;
  } else if (*context == "alloc") {
    s.context = HistoryContext::kAlloc;
  } else if (*context == "all") {
    s.context = HistoryContext::kAll;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("record_memory_history: context='", std::string(*context),
                     "' is not accepted; expected None, 'state', 'alloc' or 'all'"));
  }
  if (stacks == "python") {
    s.stacks = HistoryStacks::kPython;
  } else if (stacks == "all") {
    s.stacks = HistoryStacks::kAll;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("record_memory_history: stacks='", std::string(stacks),
                     "' is not accepted; expected 'python' or 'all'"));
  }
  if (max_entries < 1) {
    return absl::InvalidArgumentError(
        "record_memory_history: max_entries must be at least 1 (got 0)");
  }
  s.max_entries = static_cast<std::size_t>(std::min<std::uint64_t>(max_entries, SIZE_MAX));
  return s;
}

std::string_view HistoryEnabledName(HistoryEnabled enabled) {
  switch (enabled) {
    case HistoryEnabled::kState:
      return "state";
    case HistoryEnabled::kAll:
      return "all";
    case HistoryEnabled::kNone:
      break;
  }
  return "None";
}

std::string_view HistoryContextName(HistoryContext context) {
  switch (context) {
    case HistoryContext::kState:
      return "state";
    case HistoryContext::kAlloc:
      return "alloc";
    case HistoryContext::kAll:
      return "all";
    case HistoryContext::kNone:
      break;
  }
  return "None";
}

std::string_view HistoryStacksName(HistoryStacks stacks) {
  return stacks == HistoryStacks::kAll ? "all" : "python";
}

History::History(const HistorySettings& settings)
    : enabled_(settings.enabled),
      context_(settings.context),
      stacks_(settings.stacks),
      max_entries_(std::max<std::size_t>(settings.max_entries, 1)) {}

void History::Configure(const HistorySettings& settings, bool clear) {
  absl::MutexLock config_lock(&config_mu_);
  const std::size_t max_entries = std::max<std::size_t>(settings.max_entries, 1);
  const bool off = settings.enabled == HistoryEnabled::kNone;
  // Off first, so that no event is recorded half-way through the change.
  if (off) enabled_.store(HistoryEnabled::kNone, std::memory_order_release);
  context_.store(settings.context, std::memory_order_relaxed);
  stacks_.store(settings.stacks, std::memory_order_relaxed);
  max_entries_.store(max_entries, std::memory_order_relaxed);
  for (Ring& ring : rings_) {
    absl::MutexLock lock(&ring.mu);
    if (off || clear || settings.enabled != HistoryEnabled::kAll) {
      ring.slots.clear();
      ring.slots.shrink_to_fit();
      ring.head = 0;
    } else {
      Resize(ring, max_entries);
    }
    if (off || clear) ring.segment_stacks.clear();
  }
  enabled_.store(settings.enabled, std::memory_order_release);
}

HistorySettings History::settings() const {
  HistorySettings s;
  s.enabled = enabled_.load(std::memory_order_acquire);
  s.context = context_.load(std::memory_order_relaxed);
  s.stacks = stacks_.load(std::memory_order_relaxed);
  s.max_entries = max_entries_.load(std::memory_order_relaxed);
  return s;
}

void History::Resize(Ring& ring, std::size_t max_entries) {
  // Linearise (oldest first), then keep the most recent max_entries.
  if (ring.head != 0) {
    std::rotate(ring.slots.begin(), ring.slots.begin() + static_cast<std::ptrdiff_t>(ring.head),
                ring.slots.end());
    ring.head = 0;
  }
  if (ring.slots.size() > max_entries) {
    ring.slots.erase(ring.slots.begin(),
                     ring.slots.end() - static_cast<std::ptrdiff_t>(max_entries));
  }
}

void History::Push(Ring& ring, const RecordedEntry& entry, std::size_t max_entries,
                   std::atomic<std::uint64_t>& dropped) {
  if (ring.slots.size() < max_entries) {
    ring.slots.push_back(entry);  // filling: head stays 0
    return;
  }
  if (ring.slots.size() > max_entries) Resize(ring, max_entries);  // a Configure race
  ring.slots[ring.head] = entry;
  ring.head = ring.head + 1 == ring.slots.size() ? 0 : ring.head + 1;
  dropped.fetch_add(1, std::memory_order_relaxed);
}

std::uint64_t History::CaptureContext(TraceAction action) {
  const HistoryEnabled enabled = enabled_.load(std::memory_order_acquire);
  const HistoryContext context = context_.load(std::memory_order_relaxed);
  if (enabled == HistoryEnabled::kNone || context == HistoryContext::kNone) return 0;
  // Free-side stacks only in "all" mode (torch's RecordContext::ALL).
  const bool free_side =
      action == TraceAction::kFreeRequested || action == TraceAction::kFreeCompleted;
  if (free_side && context != HistoryContext::kAll) return 0;
  std::uintptr_t native[kMaxNativeFrames];
  int num_native = 0;
  if (stacks_.load(std::memory_order_relaxed) == HistoryStacks::kAll) {
    // Skip this function: the innermost frame is the allocator's Malloc or Free.
    num_native = CaptureNativeFrames(native, kMaxNativeFrames, /*skip=*/1);
  }
  PythonFrameRef python[kMaxPythonFrames];
  int num_python = 0;
  std::uint64_t hash = 0;
  {
    // The GIL is held (taken if need be) while the frames are read and new code objects are
    // retained; mu_ is only ever taken inside it, never the other way round.
    PythonStackCapture capture(python, kMaxPythonFrames);
    num_python = capture.size();
    if (num_python == 0 && num_native == 0) return 0;
    hash = HashStack(python, num_python, native, num_native);
    if (std::uint64_t id = Find(hash, python, num_python, native, num_native); id != 0) {
      return id;  // the common case: a known stack, no allocation
    }
    RetainNewCodes(python, num_python);
  }
  return Insert(hash, python, num_python, native, num_native);
}

std::uint64_t History::InternForTesting(const std::vector<PythonFrameRef>& python,
                                        const std::vector<Frame>& python_names,
                                        const std::vector<std::uintptr_t>& native) {
  const int num_python = static_cast<int>(python.size());
  const int num_native = static_cast<int>(native.size());
  if (num_python == 0 && num_native == 0) return 0;
  testing_lines_.store(true, std::memory_order_relaxed);
  {
    absl::MutexLock lock(&mu_);
    for (std::size_t i = 0; i < python.size(); ++i) {
      CodeName names;
      if (i < python_names.size()) names = {python_names[i].filename, python_names[i].name};
      code_names_.try_emplace(python[i].code, std::move(names));
    }
  }
  const std::uint64_t hash = HashStack(python.data(), num_python, native.data(), num_native);
  return Insert(hash, python.data(), num_python, native.data(), num_native);
}

bool History::SameStack(const StoredStack& s, const PythonFrameRef* python, int num_python,
                        const std::uintptr_t* native, int num_native) const {
  if (s.python_count != static_cast<std::uint32_t>(num_python) ||
      s.native_count != static_cast<std::uint32_t>(num_native)) {
    return false;
  }
  for (int i = 0; i < num_python; ++i) {
    const PythonFrameRef& f = python_frames_[s.python_begin + i];
    if (f.code != python[i].code || f.position != python[i].position) return false;
  }
  return std::equal(native, native + num_native, native_frames_.begin() + s.native_begin);
}

std::uint64_t History::FindLocked(std::uint64_t hash, const PythonFrameRef* python, int num_python,
                                  const std::uintptr_t* native, int num_native) const {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return 0;
  for (std::uint64_t id = it->second; id != 0; id = stacks_table_[id - 1].next_same_hash) {
    if (SameStack(stacks_table_[id - 1], python, num_python, native, num_native)) return id;
  }
  return 0;
}

std::uint64_t History::Find(std::uint64_t hash, const PythonFrameRef* python, int num_python,
                            const std::uintptr_t* native, int num_native) const {
  absl::MutexLock lock(&mu_);
  return FindLocked(hash, python, num_python, native, num_native);
}

void History::RetainNewCodes(const PythonFrameRef* python, int num_python) {
  std::vector<std::uintptr_t> unknown;
  {
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < num_python; ++i) {
      const std::uintptr_t code = python[i].code;
      if (!code_names_.contains(code) &&
          std::find(unknown.begin(), unknown.end(), code) == unknown.end()) {
        unknown.push_back(code);
      }
    }
  }
  if (unknown.empty()) return;
  // Python calls happen outside mu_ (a thread holding mu_ must never wait for the GIL).
  std::vector<CodeName> names(unknown.size());
  for (std::size_t i = 0; i < unknown.size(); ++i) {
    RetainPythonCode(unknown[i], &names[i].filename, &names[i].name);
  }
  absl::MutexLock lock(&mu_);
  for (std::size_t i = 0; i < unknown.size(); ++i) {
    // A racing thread may have named it first; its extra reference is harmless.
    code_names_.try_emplace(unknown[i], std::move(names[i]));
  }
}

std::uint64_t History::Insert(std::uint64_t hash, const PythonFrameRef* python, int num_python,
                              const std::uintptr_t* native, int num_native) {
  absl::MutexLock lock(&mu_);
  if (std::uint64_t id = FindLocked(hash, python, num_python, native, num_native); id != 0) {
    return id;  // another thread inserted it meanwhile
  }
  StoredStack s;
  s.hash = hash;
  s.python_begin = static_cast<std::uint32_t>(python_frames_.size());
  s.python_count = static_cast<std::uint32_t>(num_python);
  s.native_begin = static_cast<std::uint32_t>(native_frames_.size());
  s.native_count = static_cast<std::uint32_t>(num_native);
  auto it = by_hash_.find(hash);
  s.next_same_hash = it == by_hash_.end() ? 0 : it->second;
  python_frames_.insert(python_frames_.end(), python, python + num_python);
  native_frames_.insert(native_frames_.end(), native, native + num_native);
  stacks_table_.push_back(s);
  const std::uint64_t id = stacks_table_.size();
  by_hash_[hash] = id;  // the newest stack heads its chain
  return id;
}

std::size_t History::num_stacks() const {
  absl::MutexLock lock(&mu_);
  return stacks_table_.size();
}

void History::OnEvent(const TraceEntry& event) {
  const HistoryEnabled enabled = enabled_.load(std::memory_order_acquire);
  if (enabled == HistoryEnabled::kNone) return;
  if (event.device < 0 || event.device >= kMaxDevices) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const HistoryContext context = context_.load(std::memory_order_relaxed);
  RecordedEntry entry;
  entry.action = event.action;
  entry.addr = event.addr;
  entry.size = event.size;
  entry.stream = event.stream;
  entry.tag = event.tag;
  // "state" keeps stacks for blocks only; "alloc" and "all" also put them on trace entries
  // (free-side ids are 0 unless context is "all": see CaptureContext).
  entry.stack =
      context == HistoryContext::kAlloc || context == HistoryContext::kAll ? event.context : 0;
  Ring& ring = rings_[event.device];
  const bool segment_growth = IsSegmentGrowth(event.action);
  const bool segment_release = IsSegmentRelease(event.action);
  if (enabled != HistoryEnabled::kAll && !segment_growth && !segment_release) return;
  entry.time_us = NowMicros();
  absl::MutexLock lock(&ring.mu);
  if (segment_growth && event.context != 0) {
    ring.segment_stacks[event.addr] = event.context;
  } else if (segment_release && !ring.segment_stacks.empty()) {
    ring.segment_stacks.erase(event.addr);
  }
  if (enabled == HistoryEnabled::kAll) {
    Push(ring, entry, max_entries_.load(std::memory_order_relaxed), dropped_);
  }
}

void History::RecordSnapshot(int device, std::size_t active_bytes) {
  if (enabled_.load(std::memory_order_acquire) != HistoryEnabled::kAll) return;
  if (device < 0 || device >= kMaxDevices) return;
  RecordedEntry entry;
  entry.action = TraceAction::kSnapshot;
  entry.size = active_bytes;
  entry.time_us = NowMicros();
  Ring& ring = rings_[device];
  absl::MutexLock lock(&ring.mu);
  Push(ring, entry, max_entries_.load(std::memory_order_relaxed), dropped_);
}

std::vector<RecordedEntry> History::Entries(int device) const {
  std::vector<RecordedEntry> out;
  if (device < 0 || device >= kMaxDevices) return out;
  const Ring& ring = rings_[device];
  absl::MutexLock lock(&ring.mu);
  out.reserve(ring.slots.size());
  const auto head = ring.slots.begin() + static_cast<std::ptrdiff_t>(ring.head);
  out.insert(out.end(), head, ring.slots.end());
  out.insert(out.end(), ring.slots.begin(), head);
  return out;
}

std::vector<int> History::DevicesWithEntries() const {
  std::vector<int> out;
  for (int d = 0; d < kMaxDevices; ++d) {
    absl::MutexLock lock(&rings_[d].mu);
    if (!rings_[d].slots.empty()) out.push_back(d);
  }
  return out;
}

std::uint64_t History::SegmentStack(int device, DevicePtr address) const {
  if (device < 0 || device >= kMaxDevices) return 0;
  const Ring& ring = rings_[device];
  absl::MutexLock lock(&ring.mu);
  auto it = ring.segment_stacks.find(address);
  return it == ring.segment_stacks.end() ? 0 : it->second;
}

std::vector<Frame> History::Frames(std::uint64_t id) const {
  std::vector<std::uintptr_t> native;
  std::vector<PythonFrameRef> python;
  std::vector<CodeName> names;
  {
    absl::MutexLock lock(&mu_);
    if (id == 0 || id > stacks_table_.size()) return {};
    const StoredStack& s = stacks_table_[id - 1];
    native.assign(native_frames_.begin() + s.native_begin,
                  native_frames_.begin() + s.native_begin + s.native_count);
    python.assign(python_frames_.begin() + s.python_begin,
                  python_frames_.begin() + s.python_begin + s.python_count);
    for (const PythonFrameRef& f : python) {
      auto it = code_names_.find(f.code);
      names.push_back(it == code_names_.end() ? CodeName{"??", "??"} : it->second);
    }
  }
  std::vector<Frame> frames(native.size());
  std::vector<int> lines(python.size(), 0);
  std::vector<PythonFrameRef> unresolved;
  {
    absl::MutexLock lock(&symbol_mu_);
    for (std::size_t i = 0; i < native.size(); ++i) {
      auto it = symbols_.find(native[i]);
      if (it == symbols_.end()) {
        it = symbols_.emplace(native[i], SymbolizeNativeFrame(native[i])).first;
      }
      frames[i] = it->second;
    }
    for (std::size_t i = 0; i < python.size(); ++i) {
      auto it = lines_.find(LineKey(python[i]));
      if (it != lines_.end()) {
        lines[i] = it->second;
      } else if (!testing_lines_) {
        unresolved.push_back(python[i]);
      } else {
        lines[i] = python[i].position;  // InternForTesting: positions are lines
      }
    }
  }
  if (!unresolved.empty()) {
    // Outside every lock: this may take the GIL.
    std::vector<int> resolved;
    ResolvePythonLines(unresolved, &resolved);
    absl::MutexLock lock(&symbol_mu_);
    for (std::size_t i = 0; i < unresolved.size(); ++i) {
      lines_.emplace(LineKey(unresolved[i]), resolved[i]);
    }
    for (std::size_t i = 0; i < python.size(); ++i) lines[i] = lines_.at(LineKey(python[i]));
  }
  // Native frames are innermost (the allocator, then torch); the Python frames they ran under
  // follow, innermost first.
  for (std::size_t i = 0; i < python.size(); ++i) {
    frames.push_back(Frame{names[i].filename, lines[i], names[i].name, /*python=*/true});
  }
  return frames;
}

}  // namespace vramledger
